// DSA-TRT TensorRT plugins: the IPluginV3 boilerplate shared by the seven adapters, and the aliasing
// of the two in-place cache writes (included by plugin_common.h). Every TensorRT entry point is noexcept and turns a PluginError (or any
// exception) into a logged message and a non-zero status.
//
// What Derived provides (plain members, free to throw PluginError):
//   static constexpr char kName[];                    plugin name == ONNX op_type
//   static constexpr FieldSpec kFields[];             field names == ONNX attribute names
//   static constexpr int32_t kNbInputs, kNbOutputs;
//   explicit Derived(FieldValues const&);             parse + validate the fields
//   void serialize(SerialFields&) const;
//   bool supportsType(int32_t pos, nv::DynamicPluginTensorDesc const* inOut) const;   format is
//        already known to be kLINEAR; decide from inOut[0..pos] only (TensorRT's rule)
//   void outputTypes(nv::DataType* out, nv::DataType const* in) const;
//   void outputShapes(nv::DimsExprs const* in, nv::DimsExprs* out, nv::IExprBuilder& eb) const;
//   void checkShapes(nv::PluginTensorDesc const* in, nv::PluginTensorDesc const* out) const;
//        shapes of build-time descs may hold -1 extents, which the expect* helpers skip
//   int launch(inDesc, outDesc, inputs, outputs, workspace, stream) const;  returns a DsaStatus
//   optionally: size_t workspaceBytes(nv::DynamicPluginTensorDesc const* in) const;  (default 0)
#pragma once

#include <array>
#include <exception>
#include <iterator>

namespace dsa_trt
{

template <class Derived, class Build = nv::IPluginV3OneBuild>
class PluginBase : public nv::IPluginV3, public nv::IPluginV3OneCore, public Build, public nv::IPluginV3OneRuntime
{
public:
    // ------------------------------------------------------------ IPluginV3
    nv::IPluginCapability* getCapabilityInterface(nv::PluginCapabilityType type) noexcept override
    {
        switch (type)
        {
        case nv::PluginCapabilityType::kCORE: return static_cast<nv::IPluginV3OneCore*>(this);
        case nv::PluginCapabilityType::kBUILD: return static_cast<Build*>(this);
        case nv::PluginCapabilityType::kRUNTIME: return static_cast<nv::IPluginV3OneRuntime*>(this);
        }
        return nullptr;
    }

    nv::IPluginV3* clone() noexcept override
    {
        try
        {
            return new Derived(derived());
        }
        catch (std::exception const& e)
        {
            logError(Derived::kName, "clone", e.what());
        }
        return nullptr;
    }

    // ------------------------------------------------------------ IPluginV3OneCore
    char const* getPluginName() const noexcept override { return Derived::kName; }
    char const* getPluginVersion() const noexcept override { return kPluginVersion; }
    char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

    // ------------------------------------------------------------ IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override { return Derived::kNbOutputs; }

    int32_t configurePlugin(nv::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nv::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override
    {
        return guarded("configurePlugin", [&] {
            expectCounts(nbInputs, nbOutputs);
            std::array<nv::PluginTensorDesc, Derived::kNbInputs> inDescs;
            std::array<nv::PluginTensorDesc, Derived::kNbOutputs> outDescs;
            for (int32_t i = 0; i < Derived::kNbInputs; ++i)
                inDescs[i] = in[i].desc;
            for (int32_t i = 0; i < Derived::kNbOutputs; ++i)
                outDescs[i] = out[i].desc;
            derived().checkShapes(inDescs.data(), outDescs.data());
        });
    }

    int32_t getOutputDataTypes(nv::DataType* outputTypes, int32_t nbOutputs, nv::DataType const* inputTypes,
        int32_t nbInputs) const noexcept override
    {
        return guarded("getOutputDataTypes", [&] {
            expectCounts(nbInputs, nbOutputs);
            derived().outputTypes(outputTypes, inputTypes);
        });
    }

    int32_t getOutputShapes(nv::DimsExprs const* inputs, int32_t nbInputs, nv::DimsExprs const* /*shapeInputs*/,
        int32_t nbShapeInputs, nv::DimsExprs* outputs, int32_t nbOutputs,
        nv::IExprBuilder& exprBuilder) noexcept override
    {
        return guarded("getOutputShapes", [&] {
            expectCounts(nbInputs, nbOutputs);
            DSA_TRT_REQUIRE(nbShapeInputs == 0, "takes no shape inputs, got %d", nbShapeInputs);
            derived().outputShapes(inputs, outputs, exprBuilder);
        });
    }

    bool supportsFormatCombination(
        int32_t pos, nv::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept override
    {
        // Called many times while TensorRT enumerates formats: answer, never log.
        try
        {
            if (nbInputs != Derived::kNbInputs || nbOutputs != Derived::kNbOutputs || pos < 0
                || pos >= nbInputs + nbOutputs || inOut[pos].desc.format != nv::TensorFormat::kLINEAR)
                return false;
            return derived().supportsType(pos, inOut);
        }
        catch (...)
        {
            return false;
        }
    }

    size_t getWorkspaceSize(nv::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nv::DynamicPluginTensorDesc const* /*outputs*/, int32_t nbOutputs) const noexcept override
    {
        size_t bytes = 0;
        int32_t const status = guarded("getWorkspaceSize", [&] {
            expectCounts(nbInputs, nbOutputs);
            bytes = derived().workspaceBytes(inputs);
        });
        return status == 0 ? bytes : 0;
    }

    // ------------------------------------------------------------ IPluginV3OneRuntime
    int32_t onShapeChange(nv::PluginTensorDesc const* in, int32_t nbInputs, nv::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override
    {
        return guarded("onShapeChange", [&] {
            expectCounts(nbInputs, nbOutputs);
            derived().checkShapes(in, out);
        });
    }

    // Fills the params struct and calls the launcher on `stream`: no allocation, no sync, so the
    // engine stays CUDA-graph capturable.
    int32_t enqueue(nv::PluginTensorDesc const* inputDesc, nv::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override
    {
        int status = DSA_OK;
        int32_t const thrown = guarded("enqueue", [&] {
            status = derived().launch(inputDesc, outputDesc, inputs, outputs, workspace, stream);
        });
        if (thrown != 0)
            return thrown;
        if (status != DSA_OK)
        {
            char const* why = dsa_last_error_message();
            logError(Derived::kName, "enqueue", why != nullptr ? why : "kernel launcher failed");
        }
        return status;
    }

    nv::IPluginV3* attachToContext(nv::IPluginResourceContext* /*context*/) noexcept override { return clone(); }

    nv::PluginFieldCollection const* getFieldsToSerialize() noexcept override
    {
        try
        {
            mSerial.clear();
            derived().serialize(mSerial);
            return mSerial.collection();
        }
        catch (std::exception const& e)
        {
            logError(Derived::kName, "getFieldsToSerialize", e.what());
        }
        return nullptr;
    }

    // Default of the optional Derived member (hidden by a Derived that needs scratch memory).
    size_t workspaceBytes(nv::DynamicPluginTensorDesc const* /*inputs*/) const { return 0; }

protected:
    PluginBase() = default;
    PluginBase(PluginBase const&) = default;

private:
    Derived const& derived() const noexcept { return static_cast<Derived const&>(*this); }

    static void expectCounts(int32_t nbInputs, int32_t nbOutputs)
    {
        DSA_TRT_REQUIRE(nbInputs == Derived::kNbInputs && nbOutputs == Derived::kNbOutputs,
            "expects %d inputs and %d outputs, got %d and %d", Derived::kNbInputs, Derived::kNbOutputs, nbInputs,
            nbOutputs);
    }

    template <class F>
    static int32_t guarded(char const* method, F&& body) noexcept
    {
        try
        {
            body();
            return 0;
        }
        catch (std::exception const& e)
        {
            logError(Derived::kName, method, e.what());
        }
        catch (...)
        {
            logError(Derived::kName, method, "unknown exception");
        }
        return -1;
    }

    SerialFields mSerial;
};

// The in-place cache writes (DsaMlaCacheWrite, DsaIndexerKCacheWrite): their one output is the pool
// input Derived::kPool itself, same dtype, same shape, same buffer (IPluginV3OneBuildV2 aliasing).
// Derived provides the rest of PluginBase's list (outputTypes and outputShapes come from here).
template <class Derived>
class PoolWritePlugin : public PluginBase<Derived, nv::IPluginV3OneBuildV2>
{
public:
    static constexpr int32_t kPoolOut = 0; // aliases Derived::kPool

    int32_t getAliasedInput(int32_t outputIndex) noexcept override
    {
        return outputIndex == kPoolOut ? Derived::kPool : -1;
    }

    void outputTypes(nv::DataType* out, nv::DataType const* in) const
    {
        out[kPoolOut] = in[Derived::kPool];
    }

    void outputShapes(nv::DimsExprs const* in, nv::DimsExprs* out, nv::IExprBuilder& /*eb*/) const
    {
        out[kPoolOut] = in[Derived::kPool];
    }
};

template <class Plugin>
class PluginCreator : public nv::IPluginCreatorV3One
{
public:
    PluginCreator()
    {
        for (FieldSpec const& spec : Plugin::kFields)
        {
            nv::PluginFieldType const type
                = spec.kind == FieldKind::kInt ? nv::PluginFieldType::kINT32 : nv::PluginFieldType::kFLOAT32;
            mFieldNames.emplace_back(spec.name, nullptr, type, 1);
        }
        mCollection.nbFields = static_cast<int32_t>(mFieldNames.size());
        mCollection.fields = mFieldNames.data();
    }

    char const* getPluginName() const noexcept override { return Plugin::kName; }
    char const* getPluginVersion() const noexcept override { return kPluginVersion; }
    char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
    nv::PluginFieldCollection const* getFieldNames() noexcept override { return &mCollection; }

    // Build phase: the fields are the ONNX node's attributes (or the network author's collection);
    // runtime phase: what getFieldsToSerialize() wrote. Both go through the same checks.
    nv::IPluginV3* createPlugin(
        char const* /*name*/, nv::PluginFieldCollection const* fc, nv::TensorRTPhase /*phase*/) noexcept override
    {
        try
        {
            FieldValues const fields(
                Plugin::kName, fc, Plugin::kFields, static_cast<int32_t>(std::size(Plugin::kFields)));
            return new Plugin(fields);
        }
        catch (std::exception const& e)
        {
            logError(Plugin::kName, "createPlugin", e.what());
        }
        catch (...)
        {
            logError(Plugin::kName, "createPlugin", "unknown exception");
        }
        return nullptr;
    }

private:
    std::vector<nv::PluginField> mFieldNames;
    nv::PluginFieldCollection mCollection{};
};

// One static creator per plugin; plugin_library.cpp registers and exports them.
nv::IPluginCreatorV3One& mlaCacheWriteCreator() noexcept;
nv::IPluginCreatorV3One& indexerKCacheWriteCreator() noexcept;
nv::IPluginCreatorV3One& indexerLogitsCreator() noexcept;
nv::IPluginCreatorV3One& topkTranslateCreator() noexcept;
nv::IPluginCreatorV3One& sparseMlaCreator() noexcept;
nv::IPluginCreatorV3One& fp8BlockLinearCreator() noexcept;
nv::IPluginCreatorV3One& moeExpertsCreator() noexcept;

} // namespace dsa_trt
